"""Tests of the `sink` stage."""
