"""The chat-template worker of ``treedec serve``: a process that renders chat templates, within a memory and a size
budget, for :class:`treedec.serve.templates.ChatTemplateRenderer` (which kills it past its time budget).

It runs as a script (``python -I template_worker.py``), so it imports nothing of treedec and nothing from the working
directory: its ``sys.path`` is the server's, sent first. Every message is a frame: an 8-byte big-endian length,
then the payload. In: a JSON ``{"path": [...]}``, then a pickle ``{"tokenizer", "max_chars", "memory_bytes"}``, then
one JSON ``{"messages": [...]}`` per render. Out (JSON only: the server never unpickles what a template may have
influenced): ``{"ready": true}`` once set up, then per render ``{"text": ...}`` or ``{"error": kind, "message":
...}`` with kind ``"template"`` (the template raised), ``"memory"`` (it outgrew ``memory_bytes``) or ``"size"`` (its
text is longer than ``max_chars``). End of input ends it.
"""
import json
import os
import pickle
import signal
import sys


def read_frame(stream) -> bytes | None:
    header = stream.read(8)
    if len(header) < 8:
        return None
    size = int.from_bytes(header, "big")
    payload = stream.read(size)
    return payload if len(payload) == size else None


def write_frame(stream, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(8, "big") + payload)
    stream.flush()


def limit_memory(extra: int) -> None:
    """Cap the address space at what it is now plus ``extra`` bytes (Linux; elsewhere nothing is capped): a template
    building a huge string gets a MemoryError instead of the machine's memory."""
    import resource
    try:
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


def render(tokenizer, messages, max_chars: int, add_generation_prompt: bool = True) -> dict:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except MemoryError:
        return {"error": "memory", "message": "it ran out of the memory it may use"}
    except Exception as e:   # (the template's own errors: jinja2's TemplateError, raise_exception, a RecursionError)
        return {"error": "template", "message": f"{type(e).__name__}: {str(e)[:300]}"}
    if len(text) > max_chars:
        return {"error": "size", "message": f"its text has {len(text)} characters, more than {max_chars}"}
    return {"text": text}


def main() -> None:
    # (a Ctrl-C, or a supervisor's SIGINT to the server's process group, is the frontend's: it closes this input;
    # the workers printed a KeyboardInterrupt traceback each at every stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())   # (a stray print goes to stderr, not into the frames)
    sys.path[:] = json.loads(read_frame(stdin))["path"]
    setup = pickle.loads(read_frame(stdin))
    tokenizer, max_chars = setup["tokenizer"], setup["max_chars"]
    limit_memory(setup["memory_bytes"])
    write_frame(stdout, b'{"ready": true}')
    while True:
        frame = read_frame(stdin)
        if frame is None:
            return
        request = json.loads(frame)
        reply = render(tokenizer, request["messages"], max_chars, request["add_generation_prompt"])
        write_frame(stdout, json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass"))


if __name__ == "__main__":
    main()
