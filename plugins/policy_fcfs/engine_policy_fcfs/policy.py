from engine.interfaces import SchedulePolicy


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting, prefix_len):
        return sorted(waiting, key=lambda r: r.arrival)
