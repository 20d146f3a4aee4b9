#!/usr/bin/env bash
# Install Azurite (Microsoft's Azure Storage emulator, an npm package) into .ragline/tools/azurite/, for
# the tests of `type: fsspec` roots on az:// (adlfs). Node.js and npm come from the system (Debian's
# nodejs/npm). Idempotent: a stamp with the version skips the install once done. Prints the blob server's
# path. Run it by hand to try an az:// root locally:
#   "$(bash deploy/azurite/setup.sh)" --blobHost 127.0.0.1 --blobPort 10000 --inMemoryPersistence
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=3.37.0
DIR=.ragline/tools/azurite
stamp=$DIR/.ragline-azurite-installed
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$VERSION" ]; then
  command -v npm >/dev/null 2>&1 || { echo "npm not found: install Node.js and npm (apt-get install nodejs npm)" >&2; exit 1; }
  mkdir -p "$DIR"
  npm install --prefix "$DIR" --no-audit --no-fund --omit=dev --loglevel=error "azurite@$VERSION" >&2
  echo "$VERSION" > "$stamp"
fi
echo "$PWD/$DIR/node_modules/.bin/azurite-blob"
