"""Infrastructure shared by every part, the proxy included: logger names, named threads,
the event trace and retry backoff. Imports neither vLLM nor any other part of the package."""
