"""aiokvcache: asyncio-native KV-cache transfer between processes and hosts."""
