"""What a run shows of itself: metrics, trackers, profiling, timeline, plot, slow-step notices, GC schedule."""
