"""`lumen serve` with a draft model: the reply equals a plain server's (greedy), and /metrics counts the verify steps
and the drafted and accepted tokens."""

from __future__ import annotations

import httpx
import openai
from server_util import Server

import lumen_core as lumen


def test_server_with_mtp_drafting_replies_as_plain_and_reports_metrics(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5", mtp="equal")
    model = {"path": str(path), "hidden-layers": {"kv-cache": {"context-size": 512}}}
    spec = Server(lumen.load({"model": model, "draft": {"mtp": True, "num-draft-tokens": 3}}, progress=False))
    plain = Server(lumen.load({"model": model}, progress=False))
    try:
        replies = []
        for srv in (spec, plain):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count to five."}],
                                               max_tokens=24, temperature=0)
            replies.append(r.choices[0].message.content)
        assert replies[0] == replies[1]
        metrics = httpx.get(spec.url + "/metrics").text
        counters = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                    if line.startswith("lumen_speculative_")}
        assert counters["lumen_speculative_verifies_total"] > 0
        assert counters["lumen_speculative_accepted_tokens_total"] == counters["lumen_speculative_drafted_tokens_total"]
        assert "lumen_speculative_" not in httpx.get(plain.url + "/metrics").text
    finally:
        for srv in (spec, plain):
            srv.stop()
            srv.app.state.engine.close()
