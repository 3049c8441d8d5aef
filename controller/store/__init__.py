"""The job's Redis keys, read and written by every side through `Store`, and the connection to
Redis (a URL, Sentinel, TLS)."""
