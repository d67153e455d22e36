#!/usr/bin/env bash
# A test CA and one certificate per service (SAN: the compose service name, localhost,
# 127.0.0.1), for docker/compose.secure.yml or the --tls-* flags.  bash scripts/make_certs.sh DIR
set -euo pipefail
DIR=${1:-certs}; mkdir -p "$DIR"; cd "$DIR"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
  -subj "/CN=specserve CA" -keyout ca.key -out ca.pem 2>/dev/null
for name in gateway verifier drafter client; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
    -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf "subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n" \
    "$name" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$name.ext" -out "$name.pem" 2>/dev/null
  rm "$name.csr" "$name.ext"
done
chmod 600 ./*.key
echo "certificates in $DIR: ca.pem, {gateway,verifier,drafter,client}.{pem,key}"
