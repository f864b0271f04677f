"""What a run read, written to its output_dir for the user: the sample ids each step trained
(`consumed/<dp rank>.txt`) and the distinct bad samples its data loader met (`bad_samples/<dp rank>.tsv`).
The trainer records both after every step on the processes that read data."""

from __future__ import annotations

from pathlib import Path


class SampleAudit:
    """This process's audit files in `output_dir`, named by its data-parallel rank `dp_rank`;
    nothing is written where `reads_data` is false."""

    def __init__(self, output_dir: Path, dp_rank: int, reads_data: bool):
        self.output_dir, self.dp_rank, self.reads_data = Path(output_dir), dp_rank, reads_data
        self._bad_listed = 0   # distinct bad samples in output_dir/bad_samples/ (record_bad_samples)

    def record_samples(self, step: int, micro_batches: list) -> None:
        """Append this step's sample ids to output_dir/consumed/<dp rank>.txt (one line per step).

        An audit trail of what the model saw: after a resume the steps since the last checkpoint
        are trained again and appear twice; the later line of a step is the one that counted.
        """
        if not self.reads_data:
            return
        path = self.output_dir / "consumed" / f"{self.dp_rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = [i for mb in micro_batches for i in mb.sample_ids]
        with open(path, "a") as consumed:  # opened per step: a line a step, and no handle left open
            consumed.write(f"{step} {' '.join(ids)}\n")

    def record_bad_samples(self, loader, cp_rank: int) -> int:
        """Rewrite output_dir/bad_samples/<dp rank>.tsv (sample id, reason, detail) whenever this
        rank's record of distinct bad samples grows (the loader's `known_bad`, read on cp rank 0);
        returns its size (0 on ranks without data)."""
        record = getattr(loader, "known_bad", None) if cp_rank == 0 else None
        if not self.reads_data or record is None:
            return 0
        if len(record) != self._bad_listed:
            path = self.output_dir / "bad_samples" / f"{self.dp_rank}.tsv"
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = [f"{sample_id}\t{reason}\t{' '.join(detail.split())}\n"
                     for sample_id, (reason, detail) in sorted(loader.bad_samples.items())]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("sample_id\treason\tdetail\n" + "".join(lines))
            tmp.replace(path)
            self._bad_listed = len(record)
        return len(record)
