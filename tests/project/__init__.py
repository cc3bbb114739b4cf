"""Tests of the project itself: lint, docs, README, the typed API."""
