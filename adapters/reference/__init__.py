"""The reference adapter."""
