"""Tests of the `identify` stage."""
