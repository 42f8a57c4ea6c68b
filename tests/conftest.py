"""Shared fixtures for our own tests."""

from __future__ import annotations
