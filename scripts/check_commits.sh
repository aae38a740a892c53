#!/usr/bin/env bash
# Commit subjects are at most 72 characters; the details go in the body. Checks the commits of
# a range, by default those on this branch that main does not have (run it before merging):
#   bash scripts/check_commits.sh                 # main..HEAD
#   bash scripts/check_commits.sh A..B            # any range
# Commits older than the one that added this script are never checked: the rule starts there.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=72
range="${1:-main..HEAD}"
floor="$(git log --diff-filter=A --format=%H -- scripts/check_commits.sh | tail -n 1)"
bad=0
while IFS=$'\t' read -r hash subject; do
    if [ -n "$floor" ] && [ "$hash" != "$floor" ] && git merge-base --is-ancestor "$hash" "$floor"; then
        continue  # history from before the rule
    fi
    if [ "${#subject}" -gt "$limit" ]; then
        echo "${hash:0:10}: subject is ${#subject} characters (at most $limit; move the details to the body): $subject" >&2
        bad=1
    fi
done < <(git log --no-merges --format=$'%H\t%s' "$range")
if [ "$bad" -ne 0 ]; then
    echo "check_commits: reword these subjects (git rebase -i, before they reach main)" >&2
    exit 1
fi
echo "check_commits: every subject in $range is at most $limit characters" >&2
