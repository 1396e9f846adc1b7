"""A user's own package, trained with nothing but the ignite-mgpu CLI (docs/tutorials/first-project.md)."""
