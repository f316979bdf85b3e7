"""Check a store's catalog against its drives, and rebuild it from the drives' extent headers.

Without ``--repair`` nothing is written: the report says how many objects the drives hold intact
(verified header and payload checksums), how many of them the catalog lacks and how many catalog
objects are not found.  ``--repair`` (with the store closed) moves the old catalog files aside
(renamed ``*.damaged-<time>``) and writes the rebuilt catalog; the drives are never written.
Exit status: 0 when the catalog is consistent or was repaired, 1 when the dry run found problems.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvswarm.argtypes import check_drive_paths, positive_int
from kvswarm.errors import KVSwarmError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drives", nargs="+", help="the store's drive paths, in order")
    p.add_argument("--meta-dir", help="catalog directory (default: the first drive that is a directory)")
    p.add_argument("--repair", action="store_true", help="write the rebuilt catalog (old files kept aside)")
    p.add_argument("--stripe-unit", type=positive_int, default=None,
                   help="the store's stripe unit in bytes, if its manifest is lost (default: found from the drives)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    import os

    from kvswarm.recovery import recover

    meta = args.meta_dir or next((p for p in args.drives if os.path.isdir(p)), None)
    try:
        check_drive_paths(args.drives, args.meta_dir)
        report = recover(args.drives, meta, apply=args.repair, stripe_unit=args.stripe_unit)
    except KVSwarmError as e:
        print(f"kvswarm fsck: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        for d in report.drives:
            print(f"drive {d.index} {d.path}: {d.extents} extents intact, {d.corrupt} corrupt"
                  + (f" ({d.error})" if d.error else ""))
        print(f"store {report.store_uuid}: {report.objects} objects recovered ({report.extents} extents), "
              f"{report.conflicts} found in several generations (newest kept), {report.incomplete} incomplete")
        if report.manifest_error:
            print(f"manifest: {report.manifest_error}")
        if report.catalog_error:
            print(f"catalog: unreadable: {report.catalog_error}")
        else:
            print(f"catalog: {report.catalog_objects} objects; {report.not_in_catalog} recovered objects it lacks, "
                  f"{report.not_on_drives} of its objects not found intact on the drives")
        if report.applied:
            print(f"repaired: the catalog now holds the {report.objects} recovered objects; old files kept as "
                  + (", ".join(report.moved_aside) or "(none)"))
        elif not report.consistent:
            print("run again with --repair (the store closed) to write the rebuilt catalog")
    return 0 if report.applied or report.consistent else 1
