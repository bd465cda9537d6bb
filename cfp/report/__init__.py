"""Plans people can read: per-block estimates (`figures`), `cfp explain` / `cfp diff` text and plan plots."""
