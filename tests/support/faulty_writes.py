"""Wrong copies injected at the weight exchange's writer, for verification tests: each fault
writes ``src`` into ``dst`` wrongly, while the sender's CRC stays honest (of what it read)."""

import torch

from tandem.exchange.checksum import source_crc32


def shifted(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every row one place down (the last wraps to the top): an off-by-one-row offset."""
    dst.copy_(src.roll(1, 0) if src.dim() and src.shape[0] > 1 else src)


def faulty_sender(fault):
    """A `SenderHalf.write_box` that checksums the source honestly and writes with ``fault``."""

    def write_box(self, src, dst):
        crc = source_crc32(src, dst.dtype) if self.settings.verify else None  # honest CRC
        fault(src, dst)
        return crc

    return write_box
