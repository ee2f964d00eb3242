"""Query buckets of the graphed steps (PlanBounds.query_bucket): powers of two up to 256 queries, past it four
5/8, 3/4 and all of the next power of two (each row of a bucket runs the GEMMs; past the knee rows cost their
arithmetic)."""
from treedec.attention.static_plan import POW2_QUERY_BUCKETS, PlanBounds


def test_query_buckets_are_powers_of_two_up_to_256_then_five_eighths_three_quarters_or_all_of_the_next():
    bucket = PlanBounds.query_bucket
    assert [bucket(n) for n in (1, 2, 3, 5, 64, 65, 200, 256)] == [1, 2, 4, 8, 64, 128, 256, 256]
    assert POW2_QUERY_BUCKETS == 256
    assert [bucket(n) for n in (257, 264, 320, 321, 384, 385, 448, 512, 513, 641, 769, 2048, 2049)] == [
        320, 320, 320, 384, 384, 512, 512, 512, 640, 768, 1024, 2048, 2560]


def test_every_bucket_holds_its_queries_and_wastes_at_most_a_third_past_256():
    previous = 0
    for n in range(1, 5000):
        b = PlanBounds.query_bucket(n)
        assert b >= n and b >= previous   # holds the queries, never shrinks as they grow
        if n > POW2_QUERY_BUCKETS:
            assert b < 4 / 3 * n
        previous = b
