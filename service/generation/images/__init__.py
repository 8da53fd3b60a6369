"""Images in prompts (vision-language models): where an image comes from (`refs`), fetching and
decoding it safely (`fetch`), and preprocessing it with the model's own transformers processor
into pixel values and placeholder tokens (`pipeline`). The engine carries the result
(`service.engine.contracts.ImageInput`) to the shards."""
