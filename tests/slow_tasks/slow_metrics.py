"""process_results of the ``mpitp_slow_metrics_mc`` test task: lm-eval's accuracy, after ``testing.stall("metrics")``
(``MPITP_TEST_STALL=metrics:<s>`` makes rank 0's metrics phase last as long as a drill needs)."""

from mpitp import testing


def process_results(doc, results):
    testing.stall("metrics")
    lls = [ll for ll, _ in results]
    return {"acc": float(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])}
