"""Console entry points; the only place ``main`` functions live."""
