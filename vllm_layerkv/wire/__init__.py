"""The wire format: msgspec messages with their version and compatibility hash, and the
length-prefixed framing that carries them."""
