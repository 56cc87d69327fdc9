"""The plan of a model with its vision tower (issue 17): the ``vision`` block places the tower as the row
``vision`` (its tensors' bytes, where the block says), with a row for the tower's working memory on the largest
image the preprocessor accepts; without the block the tower is skipped, with a reason."""

from __future__ import annotations

import pytest

from lumen_core.engine import prepare
from lumen_core.plan import VISION_SCORES_BOUND, format_plan


@pytest.mark.parametrize("kind", ["qwen3_5_vl", "gemma4_mm", "gemma3_vl"])
def test_the_tower_is_a_placed_row_with_its_activations(kind, tiny_checkpoint):
    path = str(tiny_checkpoint(kind))
    config, ckpt, arch, plan, resolved = prepare({"model": {"path": path, "store": "ram"},
                                                  "vision": {"compute": "cpu", "store": "mmap"}})
    rows = {e.component: e for e in plan.entries}
    tower = rows["vision"]
    names = resolved["layout"].needs[("vision", None)]
    assert names and (tower.device, tower.store) == ("cpu", "mmap")
    assert tower.nbytes >= sum(ckpt.tensors[n].nbytes for n in names if arch.is_matrix(n))
    act = next(e for e in plan.entries if e.component.startswith("vision activations"))
    assert act.kind == "cache" and act.device == "cpu" and 0 < act.nbytes
    processor = arch.image_processor(ckpt.preprocessor_config())
    vc = arch.config["vision_config"]
    patches, hidden = processor.max_patches, vc["hidden_size"]
    assert f"{patches} patches" in act.component and act.nbytes >= patches * hidden * 4
    assert act.nbytes <= patches * (4 * hidden + vc["intermediate_size"]) * 4 + VISION_SCORES_BOUND
    assert "vision activations" in format_plan(plan)
    # without the block: no tower row, its tensors skipped on purpose
    _, _, _, text_plan, text = prepare({"model": {"path": path}})
    assert "vision" not in {e.component for e in text_plan.entries}
    assert any("vision" in reason for reason in text["layout"].skipped.values())


@pytest.mark.parametrize("kind", ["qwen3_5_vl"])  # (the tiny Gemma towers' depth is fixed by make_tiny_checkpoint)
def test_a_tower_deeper_than_the_text_model_is_not_a_layer_count_mismatch(kind, tiny_checkpoint):
    """The tower's own blocks are named ``...layers.N`` too: with the vision block on, the layer-count check counts
    the text model's layers only (here a 4-layer text model under a 6-block tower)."""
    path = str(tiny_checkpoint(kind, vision_config={"depth": 6}))
    plan = prepare({"model": {"path": path}, "vision": {"compute": "cpu"}})[3]
    assert "vision" in {e.component for e in plan.entries}
