"""Tests of the `merge` stage."""
