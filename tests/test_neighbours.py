"""kazeia/neighbours.py: whether other work takes this process's CPUs, from /proc/stat's busy
ticks less the process's own CPU time over a window; a clock and readers are injected, so nothing
here depends on what the machine does meanwhile."""

from kazeia.neighbours import BUSY_CORES, WINDOW_S, Neighbours, busy_seconds

STAT = """cpu  900 10 300 5000 40 5 5 30 0 0
cpu0 400 5 100 2500 20 2 3 10 0 0
cpu1 500 5 200 2500 20 3 2 20 0 0
cpu10 7 0 0 0 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_seconds_sums_the_busy_fields_of_the_cpus_asked_for():
    # cpu0: user 400 + nice 5 + system 100 + irq 2 + softirq 3 + steal 10 (idle and iowait are not busy)
    assert busy_seconds(STAT, {0}, 0.01) == 5.20
    assert abs(busy_seconds(STAT, {0, 1}, 0.01) - (5.20 + 7.30)) < 1e-9
    assert busy_seconds(STAT, {1, 10}, 1.0) == 730 + 7  # "cpu10" is not "cpu1"; the total line never counts
    assert busy_seconds(STAT, {5}, 1.0) == 0


class Machine:
    """A clock, the CPUs' busy seconds and the process's own, moved by the test."""

    def __init__(self, readable: bool = True):
        self.now, self.busy, self.own, self.readable = 100.0, 50.0, 3.0, readable

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass; this process uses `ours` cores, other work `others`."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def neighbours(self) -> Neighbours:
        return Neighbours(lambda: self.busy if self.readable else None, lambda: self.own, lambda: self.now)


def test_others_use_over_a_window_decides_and_the_verdict_holds_between_looks():
    machine = Machine()
    neighbours = machine.neighbours()
    assert neighbours.busy()  # nothing measured yet: busy
    machine.run(WINDOW_S, ours=1.9, others=0.05)  # our own two threads do not count
    assert not neighbours.busy()
    machine.run(WINDOW_S / 2, ours=0.0, others=2.0)
    assert not neighbours.busy()  # within the window: the last verdict
    machine.run(WINDOW_S, ours=1.0, others=0.9)
    assert neighbours.busy()  # a neighbour holding most of a core
    machine.run(WINDOW_S, ours=1.0, others=BUSY_CORES / 2)
    assert not neighbours.busy()


def test_where_nothing_can_be_told_the_caller_decides():
    """Before the first window and where nothing can be read, `busy` answers what its caller
    assumes then (`unknown`: a step borrows nothing, a prompt keeps its team); a verdict, once
    measured, whatever it assumes."""
    machine = Machine()
    neighbours = machine.neighbours()
    assert neighbours.busy() and not neighbours.busy(unknown=False)  # the first look: no window yet
    machine.run(WINDOW_S, ours=1.0, others=1.0)
    assert neighbours.busy(unknown=False) and neighbours.busy()
    machine.run(WINDOW_S, ours=1.0, others=0.0)
    assert not neighbours.busy(unknown=True) and not neighbours.busy()
    machine.readable = False  # /proc/stat gone: no verdict any more
    machine.run(WINDOW_S, ours=1.0, others=0.0)
    assert neighbours.busy() and not neighbours.busy(unknown=False)
    other = Machine(readable=False)  # another OS: never a verdict
    unreadable = other.neighbours()
    for _ in range(3):
        other.run(WINDOW_S, ours=1.0, others=0.0)
        assert unreadable.busy() and not unreadable.busy(unknown=False)
