"""Model families. Importing a family module registers its architecture names."""

from tandem.models import gpt2, llama, moe  # noqa: F401  (registration side effect)
from tandem.models.registry import register_model, registered_architectures

__all__ = ["register_model", "registered_architectures"]
