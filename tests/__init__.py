"""Test package: spawned ranks import job functions from here by module path."""
