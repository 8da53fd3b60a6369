"""Python client for the tokenwire text-generation server.

    from tokenwire_client import Client

    with Client("localhost:50051") as client:
        print(client.generate("Hello", max_new_tokens=16).generated_text)

`Client` blocks (grpcio); `AsyncClient` is for asyncio (grpclib). Both return the generated
message classes below and raise the `TokenwireError` subclasses below.
"""

from ._async import AsyncClient, AsyncStream
from ._errors import (
    CancelledError,
    DeadlineExceededError,
    GenerationError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    TokenwireError,
    UnauthenticatedError,
    UnavailableError,
    UnsupportedError,
    ValidationError,
)
from ._generated.tokenwire.v1 import (
    BestOfSequence,
    ChatContentPart,
    ChatImageUrl,
    ChatMessage,
    ChatRequest,
    ChatResponse,
    ChatStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    Details,
    GenerateParameters,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    Grammar,
    ImagePart,
    InfoResponse,
    InputChunk,
    PrefillToken,
    StreamDetails,
    Token,
    TopTokens,
)
from ._images import Image
from ._sync import Client, Stream

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "BestOfSequence",
    "CancelledError",
    "ChatContentPart",
    "ChatImageUrl",
    "ChatMessage",
    "ChatRequest",
    "ChatResponse",
    "ChatStreamResponse",
    "Client",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "DeadlineExceededError",
    "Details",
    "GenerateParameters",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateStreamResponse",
    "GenerationError",
    "Grammar",
    "Image",
    "ImagePart",
    "InfoResponse",
    "InputChunk",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "PrefillToken",
    "Stream",
    "StreamDetails",
    "Token",
    "TokenwireError",
    "TopTokens",
    "UnauthenticatedError",
    "UnavailableError",
    "UnsupportedError",
    "ValidationError",
    "__version__",
]
