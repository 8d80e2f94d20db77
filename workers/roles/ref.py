"""The reference-policy role: the frozen initial policy, log-probs for the KL term.

On CPU, weights that are a never-written private mapping of the model file (an fp32 safetensors checkpoint
loaded without conversion) are released from the process after each pass (`release_file_mapped_pages`):
the reference is read once per step, and the pages map back from the OS page cache on the next pass."""

from __future__ import annotations

from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.engine import build_engine
from rlframe.workers.host_pages import release_file_mapped_pages
from rlframe.workers.settings import RefSettings


class RefWorker:
    def __init__(self, settings: RefSettings):
        self.settings = settings
        self.profile = settings.engine.device.profile()
        self.engine = build_engine(settings.engine, self.profile, name="ref")

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.forward(data, self.settings.log_prob)
        if not self.profile.is_gpu:
            release_file_mapped_pages(self.engine.model.parameters())
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})
