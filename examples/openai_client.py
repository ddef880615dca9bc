"""Wait for a vLLM server, send one OpenAI completion request, show what DSpark did.

Usage: python examples/openai_client.py --port 8000 [--wait 300] [--prompt TEXT]
Standard library only, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def wait_until_ready(base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise SystemExit(f"server at {base} not ready after {timeout_s:.0f} s")


def complete(base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def spec_decode_metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:spec_decode", "vllm_dspark")) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if 'position="' in name or 'depth="' in name:  # per position / depth: shown one by one
                label = {k: v.strip('"') for k, v in (part.split("=", 1) for part in name.split("{")[1].rstrip("}").split(","))}
                key += "[" + " ".join(label[k] for k in ("mode", "position", "depth") if k in label) + "]"
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--wait", type=float, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompt",
        default="<|im_start|>user\nWrite a Python function that returns the factorial of n.<|im_end|>\n<|im_start|>assistant\n",
    )
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    wait_until_ready(base, args.wait)
    start = time.monotonic()
    result = complete(base, args.model, args.prompt, args.max_tokens)
    elapsed = time.monotonic() - start
    text = result["choices"][0]["text"]
    tokens = result["usage"]["completion_tokens"]
    print("=== completion ===")
    print(text)
    print(f"=== {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s) ===")
    for name, value in sorted(spec_decode_metrics(base).items()):
        print(f"{name} {value:g}")
    return 0 if text else 1


if __name__ == "__main__":
    sys.exit(main())
