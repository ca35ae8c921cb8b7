"""Test certificates made with the openssl CLI: a CA, and certificates
it signs (servers' with their addresses as subjectAltNames)."""

import os
import subprocess


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    """A CA (`<name>-ca.pem`, `<name>-ca.key`) in directory `d`."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem", "-days", "2",
            "-subj", f"/CN={name} test CA", cwd=d)


def make_cert(d, ca, name, cn, san=None, rsa=False):
    """A certificate `<name>.pem` with key `<name>.key` signed by CA `ca`
    (an RSA key in PKCS#1 when `rsa`, else an EC key in PKCS#8)."""
    if rsa:
        openssl("genrsa", "-traditional", "-out", f"{name}.key", "2048", cwd=d)
    else:
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                "-out", f"{name}.key", cwd=d)
    openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    ext = os.path.join(d, f"{name}.ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\n")
        if san:
            f.write(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
        else:
            f.write("extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}-ca.pem", "-CAkey", f"{ca}-ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext, cwd=d)
