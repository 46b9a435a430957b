"""The worker: one training loop wiring the layers together."""
