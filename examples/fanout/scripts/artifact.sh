#!/usr/bin/env bash
# package / sign / publish / notify: a release chain behind flaky-check.
# In the expected outcome these never run (flaky-check fails, so they are skipped).
set -euo pipefail
source "$(dirname "$0")/common.sh"
action="${1:?usage: artifact.sh package|sign|publish|notify}"
cd "$QLPG_RUN_DIR"
case "$action" in
    package) tar -czf artifact.tar.gz report.txt merged ;;
    sign)    sha256sum artifact.tar.gz > artifact.tar.gz.sha256 ;;
    publish) sha256sum -c artifact.tar.gz.sha256 && mkdir -p published && cp artifact.tar.gz* published/ ;;
    notify)  echo "published $(cat artifact.tar.gz.sha256)" >> notifications.log ;;
    *) echo "unknown action $action" >&2; exit 2 ;;
esac
log "$action done"
