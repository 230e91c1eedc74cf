"""A caller of executor.Sandbox in a process of its own, for tests that change who the caller is
(an unprivileged uid, root without a capability, a user namespace): runs each block of argv[1]
(JSON: {"blocks": [...], "kwargs": {...}}) alone and prints one JSON line, {"contained": bool,
"results": [[status, output], ...]} or {"error": the SandboxError's message}."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from executor import Sandbox, SandboxError  # noqa: E402


def main():
    job = json.loads(sys.argv[1])
    try:
        with Sandbox(workers=1, **job["kwargs"]) as sb:
            results = [[r.status, r.output] for r in map(sb.run, job["blocks"])]
            print(json.dumps({"contained": sb.contained, "results": results}))
    except SandboxError as e:
        print(json.dumps({"error": str(e)}))


if __name__ == "__main__":
    main()
