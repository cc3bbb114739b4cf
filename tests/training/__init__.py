"""Tests of the `training` stage."""
