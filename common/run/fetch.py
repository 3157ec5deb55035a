"""Fetch a hub model at a pinned commit into the Hugging Face cache and print its local folder.

    python -m common.run.fetch Qwen/Qwen2.5-7B-Instruct a09a35458c702b33eeacc393d103063234e8bc28

A failure is one line naming the model, the revision and HF_HOME, and a non-zero exit.
"""

import sys


def main(repo_id, revision):
    from huggingface_hub import constants, snapshot_download

    try:
        print(snapshot_download(repo_id, revision=revision))
    except Exception as e:  # any failure of the hub client is reported the same way, in one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        sys.exit(f"fetch: cannot download {repo_id} at revision {revision} into HF_HOME={constants.HF_HOME}: "
                 f"{type(e).__name__}{': ' + reason if reason else ''}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m common.run.fetch REPO_ID REVISION")
    main(sys.argv[1], sys.argv[2])
