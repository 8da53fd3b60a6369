"""Running the model: host step -> device tensors -> one forward pass (model_runner.py), decode
CUDA graphs (cuda_graphs.py), and warmup (KV-cache sizing, graph capture; warmup.py)."""
