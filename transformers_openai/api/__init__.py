"""The HTTP edge: FastAPI app, thin routes, error responses and SSE."""
