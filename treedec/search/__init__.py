"""Search programs (branch controller, ToT, beam search, speculative verification)."""
