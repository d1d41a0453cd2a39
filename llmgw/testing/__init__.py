"""Fakes and helpers that llmgw's tests (and other people's) reuse."""
