"""Model families. Importing a family module registers its architecture names."""

from tandem.models import bert, gpt2, llama, moe, reward, vit  # noqa: F401  (registration side effect)
from tandem.models.base import TandemModel
from tandem.models.registry import register_model, registered_architectures

__all__ = ["TandemModel", "register_model", "registered_architectures"]
