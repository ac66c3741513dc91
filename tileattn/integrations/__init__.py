"""Integrations of tileattn into other libraries (imported on demand, never by ``import tileattn``)."""
