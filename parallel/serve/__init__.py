"""``reshard serve``'s HTTP side: OpenAI's protocol (:mod:`.protocol`), the front end between the
HTTP handlers and the job's router (:mod:`.front`), the metrics (:mod:`.metrics`) and the FastAPI
application with its uvicorn thread (:mod:`.app`). FastAPI and uvicorn (base dependencies) are
imported when a server is built."""

from reshard.parallel.serve.app import HttpServer, Text, build_app
from reshard.parallel.serve.front import Front, ServeLimits, Stream
from reshard.parallel.serve.metrics import Metrics
from reshard.parallel.serve.protocol import BadRequest, Limits, Parsed, parse

__all__ = [
    "BadRequest",
    "Front",
    "HttpServer",
    "Limits",
    "Metrics",
    "Parsed",
    "ServeLimits",
    "Stream",
    "Text",
    "build_app",
    "parse",
]
