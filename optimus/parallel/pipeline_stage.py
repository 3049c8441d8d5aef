"""The pipeline stage Optimus gives torch's schedules (optimus/parallel/pipeline.py
`build_schedule`): a module of its own so that `torch.distributed.pipelining`, which imports
dynamo, is imported only by a rank that builds a pipeline."""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from optimus.models.moe import moe_pass


class Stage(PipelineStage):
    """A PipelineStage whose one-time metadata inference leaves no trace in MoE counters.

    At its first step torch runs each stage once on placeholder tensors (uninitialised memory
    of the right shapes), with grad, to infer the shapes it sends. MoE layers would count that
    pass's routing as training load (and its auxiliary loss), and sum its counts with other
    ranks. Giving every stage static metadata instead would avoid the pass, but under tensor
    parallelism the last stage returns a DTensor, which then needs gradient metadata for every
    stage too; so the pass runs as a dry one (`moe_pass("dry")`: nothing counted, no
    collective). torch 2.13 has no public hook there: this overrides the private method that
    runs it (pinned torch, see pyproject.toml).
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        with moe_pass("dry"):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self):
        """The warm-up exchange with the neighbouring stages, less those on this rank itself.

        A V-shaped schedule (zbv_zero_bubble, dualpipev) puts two adjacent stages on one rank,
        and torch 2.11's first step sends a warm-up tensor between every adjacent pair: to
        itself there, which gloo refuses ("Pair is not connected"; NCCL allows it). Activations
        between two stages of one rank never cross the wire, so nothing needs warming up;
        torch 2.13 warms up by a vote instead and calls this only on its fallback path."""
        return [op for op in super()._get_init_p2p_neighbors_ops()
                if op.group_peer != self.group_rank]
