"""The sglang adapter."""
