"""The wire format: msgspec messages with their version and compatibility hash, the
length-prefixed framing that carries them, and the registry of direct-write planes whose
names and exports they carry."""
