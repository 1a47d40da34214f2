"""Integrations with other stacks; each imports its stack lazily."""
