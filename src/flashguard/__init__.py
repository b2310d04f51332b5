"""flashguard: find, explain and fix the loss explosions of low-precision flash attention."""
__version__ = "0.1.0"
