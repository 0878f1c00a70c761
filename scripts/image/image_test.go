package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// MaxImageBytes is the image's size budget (issue 37: under 40 MB).
const MaxImageBytes = 40 << 20

// TestImage builds escrow as `make image` does (a static binary, CGO_ENABLED=0; no -trimpath) and its image,
// then checks the tarball as a registry or `docker load` would read it: the OCI layout and the
// docker archive agree; every blob matches its digest; the config runs /escrow serve as the
// non-root user 65532 with the CA bundle's path; the one layer holds exactly the binary, the CA
// bundle, passwd/group, /tmp and /var/lib/escrow (no shell); the tarball is under 40 MB; the
// binary is static (no ELF interpreter), and the one taken out of the image runs.
func TestImage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	bin := filepath.Join(dir, "escrow")
	// As `make image`, but without -trimpath, which only rewrites the file paths recorded in the
	// binary: with it every package would be compiled again for this one build, beside the
	// CGO_ENABLED=0 build configuration the suite's other builds share (go vet's among them).
	build := exec.Command("go", "build", "-ldflags=-s -w", "-o", bin, "./cmd/escrow")
	build.Dir = "../.."
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ca := "/etc/ssl/certs/ca-certificates.crt"
	if _, err := os.Stat(ca); err != nil {
		ca = filepath.Join(dir, "ca.pem") // a machine without the bundle: any PEM shows the path
		if err := os.WriteFile(ca, []byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The image as `make image` writes it: this program run on its own, built without the race
	// detector (under it, the gzip of the binary at BestCompression alone cost ~40 s of CPU).
	tarPath := filepath.Join(dir, "escrow-image.tar")
	gen := exec.Command("go", "run", ".", "-binary", bin, "-ca", ca, "-tag", "escrow:test", "-out", tarPath)
	gen.Env = append(os.Environ(), "CGO_ENABLED=0", "SOURCE_DATE_EPOCH=0")
	genOut, err := gen.CombinedOutput()
	if err != nil {
		t.Fatalf("go run ./scripts/image: %v\n%s", err, genOut)
	}
	_, digest, _ := strings.Cut(string(genOut), "manifest ")
	digest, _, _ = strings.Cut(digest, ")")
	st, _ := os.Stat(tarPath)
	t.Logf("image: %d bytes (%.1f MB), manifest %s", st.Size(), float64(st.Size())/(1<<20), digest)
	if st.Size() >= MaxImageBytes {
		t.Fatalf("image is %d bytes, budget %d", st.Size(), MaxImageBytes)
	}

	// The tarball's entries.
	entries := map[string][]byte{}
	raw, _ := os.ReadFile(tarPath)
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			b, _ := io.ReadAll(tr)
			entries[h.Name] = b
		}
	}
	for name, b := range entries {
		if d, ok := strings.CutPrefix(name, "blobs/sha256/"); ok {
			if s := sha256.Sum256(b); hex.EncodeToString(s[:]) != d {
				t.Fatalf("blob %s does not match its digest", name)
			}
		}
	}
	if string(entries["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout: %s", entries["oci-layout"])
	}
	blob := func(d string) []byte {
		b, ok := entries["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")]
		if !ok {
			t.Fatalf("no blob %s", d)
		}
		return b
	}
	var idx index
	if err := json.Unmarshal(entries["index.json"], &idx); err != nil || len(idx.Manifests) != 1 || idx.Manifests[0].Digest != digest ||
		idx.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "test" {
		t.Fatalf("index.json: %s %v", entries["index.json"], err)
	}
	var man manifest
	if err := json.Unmarshal(blob(digest), &man); err != nil || len(man.Layers) != 1 {
		t.Fatalf("manifest: %v", err)
	}
	var dm []dockerManifest
	if err := json.Unmarshal(entries["manifest.json"], &dm); err != nil || len(dm) != 1 || dm[0].RepoTags[0] != "escrow:test" ||
		dm[0].Config != "blobs/sha256/"+strings.TrimPrefix(man.Config.Digest, "sha256:") ||
		dm[0].Layers[0] != "blobs/sha256/"+strings.TrimPrefix(man.Layers[0].Digest, "sha256:") {
		t.Fatalf("manifest.json (docker load) and the OCI manifest disagree: %s", entries["manifest.json"])
	}

	// The config: non-root, the entrypoint, the layer's diff id.
	var cfg Config
	if err := json.Unmarshal(blob(man.Config.Digest), &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Config.User != "65532:65532" || !slices.Equal(cfg.Config.Entrypoint, []string{"/escrow"}) || !slices.Equal(cfg.Config.Cmd, []string{"serve"}) ||
		cfg.OS != "linux" || cfg.Architecture != runtime.GOARCH || !slices.Contains(cfg.Config.Env, "ESCROW_ADDR=0.0.0.0:8080") {
		t.Fatalf("config: %+v", cfg)
	}
	zr, err := gzip.NewReader(bytes.NewReader(blob(man.Layers[0].Digest)))
	if err != nil {
		t.Fatal(err)
	}
	layerTar, _ := io.ReadAll(zr)
	if s := sha256.Sum256(layerTar); cfg.RootFS.DiffIDs[0] != "sha256:"+hex.EncodeToString(s[:]) {
		t.Fatal("the config's diff id is not the layer's")
	}

	// The layer's files.
	files := map[string]*tar.Header{}
	var escrowBin, passwd []byte
	lr := tar.NewReader(bytes.NewReader(layerTar))
	for {
		h, err := lr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = h
		switch h.Name {
		case "escrow":
			escrowBin, _ = io.ReadAll(lr)
		case "etc/passwd":
			passwd, _ = io.ReadAll(lr)
		}
	}
	var names []string
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	want := []string{"escrow", "etc/", "etc/group", "etc/passwd", "etc/ssl/", "etc/ssl/certs/", "etc/ssl/certs/ca-certificates.crt",
		"tmp/", "var/", "var/lib/", "var/lib/escrow/"}
	if !slices.Equal(names, want) {
		t.Fatalf("layer files %v, want %v", names, want)
	}
	if files["escrow"].Mode != 0o755 || files["var/lib/escrow/"].Uid != UID || files["tmp/"].Mode != 0o1777 {
		t.Fatalf("modes: escrow %o, /var/lib/escrow uid %d, /tmp %o", files["escrow"].Mode, files["var/lib/escrow/"].Uid, files["tmp/"].Mode)
	}
	if !strings.Contains(string(passwd), "escrow:x:65532:65532:") {
		t.Fatalf("passwd: %s", passwd)
	}

	// The binary out of the image: static, and it runs.
	out := filepath.Join(dir, "escrow-from-image")
	if err := os.WriteFile(out, escrowBin, 0o755); err != nil {
		t.Fatal(err)
	}
	ef, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			t.Fatal("the binary is dynamically linked (it has an ELF interpreter): build it with CGO_ENABLED=0")
		}
	}
	ef.Close()
	help, err := exec.Command(out, "help").CombinedOutput()
	if err != nil || !strings.Contains(string(help), "serve") {
		t.Fatalf("escrow help from the image: %v\n%s", err, help)
	}
	usage, _ := exec.Command(out, "serve", "-h").CombinedOutput()
	if !strings.Contains(string(usage), "ESCROW_CONSOLE") {
		t.Fatalf("escrow serve -h from the image does not list its settings:\n%s", usage)
	}
}
