"""Generate text from the `llm` model: prints tokens as they arrive, then TTFT and tokens/s.

    python clients/generate.py "Tell me a joke" --stream --protocol grpc
    python clients/generate.py "Summarize: ..." --mode prod --algorithm ngram --api-key team-a
"""

from __future__ import annotations

import argparse
import sys
import time

from specgate.contract import SPEC_ALGORITHMS
from specgate_client import GenerateParams, GrpcClient, HttpClient, ServerError, ServerUnreachable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http")
    ap.add_argument("--url", default=None, help="host:port (default localhost:8000 http / localhost:8001 grpc)")
    ap.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    ap.add_argument("--mode", choices=["off", "shadow", "prod"], default=None, help="x-speculative-decoding")
    ap.add_argument("--api-key", default=None, help="x-api-key (tenant)")
    ap.add_argument("--algorithm", choices=SPEC_ALGORITHMS, default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    a = ap.parse_args()

    p = GenerateParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=a.stop,
        apply_chat_template=not a.raw, speculative_algorithm=a.algorithm, num_speculative_tokens=a.num_speculative_tokens,
    )
    t0 = time.perf_counter()
    try:
        if a.protocol == "http":
            c = HttpClient(a.url or "localhost:8000")
            chunks = c.stream(a.prompt, p, a.api_key, a.mode) if a.stream else iter([c.generate(a.prompt, p, a.api_key, a.mode).chunks[0]])
        else:
            chunks = GrpcClient(a.url or "localhost:8001").stream(a.prompt, p, a.api_key, a.mode, stream=a.stream)
        ttft, last = None, None
        for ch in chunks:
            if ch.text and ttft is None:
                ttft = ch.t
            sys.stdout.write(ch.text)
            sys.stdout.flush()
            last = ch
    except ServerUnreachable as exc:
        sys.exit(f"error: {exc}. Is the server up? Start it with `make serve` and wait for \"[serve] ready\".")
    except ServerError as exc:
        sys.exit(f"\nerror: {exc}")
    total = time.perf_counter() - t0
    m = last.meta if last else {}
    print(
        f"\n\n--- route={m.get('route')} reason={m.get('gate_reason')} "
        f"drafts accepted {m.get('num_accepted_tokens')}/{m.get('num_draft_tokens')}"
        f" | TTFT {1000 * (ttft or total):.0f} ms | {m.get('num_output_tokens')} tokens in {total:.2f} s"
        f" = {(m.get('num_output_tokens') or 0) / total:.1f} tok/s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
