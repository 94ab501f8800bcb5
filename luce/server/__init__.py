"""The HTTP server: OpenAI, Anthropic and Responses APIs over one engine (see docs/server.md)."""


def create_app(model, **kw):
    """The ASGI app serving a loaded luce Model; keywords as luce.server.app.ServerState."""
    from .app import create_app as _create_app
    return _create_app(model, **kw)


__all__ = ["create_app"]
