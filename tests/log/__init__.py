"""Tests of the `log` stage."""
