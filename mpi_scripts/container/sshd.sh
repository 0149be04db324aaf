#!/bin/sh
# The sshd of Horovod's Docker pattern, as the image's own user (it can log in only as itself), on
# port $1 [12345], in the foreground. Its keys are mounted at run time in ~/.ssh: host_ed25519 (the
# host key), authorized_keys, and the client's id_ed25519, config and known_hosts. The image's
# root is read-only: the configuration goes to /tmp.
set -eu
port=${1:-12345}
keys=$HOME/.ssh
dir=/tmp/hvd_train-sshd
mkdir -p "$dir"
cat >"$dir/sshd_config" <<CONFIG
Port $port
HostKey $keys/host_ed25519
AuthorizedKeysFile $keys/authorized_keys
PidFile $dir/sshd.pid
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The mounted files belong to the mount's owner, not to a home sshd would check.
StrictModes no
CONFIG
exec /usr/sbin/sshd -D -e -f "$dir/sshd_config"
