"""Server runtime shared by the coordinator, the workers and the aggregated server: the engine loop,
request validation, the client-facing servicer, metrics, health and shutdown."""
