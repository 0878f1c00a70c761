// Command image writes escrow's container image without a container engine: an image FROM
// scratch holding the static binary (/escrow), the CA bundle (/etc/ssl/certs/ca-certificates.crt),
// /etc/passwd and /etc/group naming the non-root user escrow (65532), an empty /tmp and
// /var/lib/escrow (for ESCROW_JOURNAL_DIR) owned by it; no shell. The output is one tarball
// that is both an OCI image layout (oci-layout, index.json, blobs/sha256/…) and a `docker save`
// archive (manifest.json), so `docker load -i` and OCI tools (skopeo, podman, crane) take it.
//
//	CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o bin/escrow ./cmd/escrow
//	go run ./scripts/image -binary bin/escrow -out bin/escrow-image.tar -tag escrow:latest
//
// `make image` runs both. The layer's files carry one fixed time (SOURCE_DATE_EPOCH, else the
// Unix epoch), so the same binary gives the same image digest.
package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// The image's user and its files.
const (
	UID        = 65532
	User       = "escrow"
	BinaryPath = "escrow"
	CAPath     = "etc/ssl/certs/ca-certificates.crt"
	Port       = "8080/tcp"
)

// Options say what goes into the image.
type Options struct {
	Binary string    // the static escrow binary
	CA     string    // the CA bundle (PEM)
	Tag    string    // repository:tag, for docker load and the OCI ref name
	Time   time.Time // the files' and the image's time
	Arch   string    // GOARCH of the binary
}

// Image is what Build wrote: the digests and sizes.
type Image struct {
	ManifestDigest, ConfigDigest, LayerDigest, DiffID string
	LayerSize                                         int64
}

// Config is the image config (the fields escrow sets; OCI image-spec "config").
type Config struct {
	Created      time.Time `json:"created"`
	Architecture string    `json:"architecture"`
	OS           string    `json:"os"`
	Config       struct {
		User         string              `json:"User"`
		Entrypoint   []string            `json:"Entrypoint"`
		Cmd          []string            `json:"Cmd"`
		Env          []string            `json:"Env"`
		ExposedPorts map[string]struct{} `json:"ExposedPorts"`
		WorkingDir   string              `json:"WorkingDir"`
		Labels       map[string]string   `json:"Labels"`
	} `json:"config"`
	RootFS struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
	History []struct {
		Created   time.Time `json:"created"`
		CreatedBy string    `json:"created_by"`
	} `json:"history"`
}

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

type index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

// dockerManifest is an entry of a docker save archive's manifest.json.
type dockerManifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// layer is the image's one layer: an uncompressed tar (its digest is the config's diff id) and
// its gzip.
func layer(o Options) (raw, gz []byte, err error) {
	bin, err := os.ReadFile(o.Binary)
	if err != nil {
		return nil, nil, err
	}
	ca, err := os.ReadFile(o.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("CA bundle: %w", err)
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/:/sbin/nologin\n%s:x:%d:%d:%s:/var/lib/escrow:/sbin/nologin\n", User, UID, UID, User)
	group := fmt.Sprintf("root:x:0:\n%s:x:%d:\n", User, UID)
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	dir := func(name string, mode int64, uid int) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: mode, Uid: uid, Gid: uid, ModTime: o.Time, Format: tar.FormatPAX})
	}
	file := func(name string, mode int64, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: o.Time, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	steps := []error{
		dir("etc", 0o755, 0), file("etc/passwd", 0o644, []byte(passwd)), file("etc/group", 0o644, []byte(group)),
		dir("etc/ssl", 0o755, 0), dir("etc/ssl/certs", 0o755, 0), file(CAPath, 0o644, ca),
		dir("tmp", 0o1777, 0), dir("var", 0o755, 0), dir("var/lib", 0o755, 0), dir("var/lib/escrow", 0o700, UID),
		file(BinaryPath, 0o755, bin), tw.Close(),
	}
	if err := errors.Join(steps...); err != nil {
		return nil, nil, err
	}
	var z bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&z, gzip.BestCompression)
	zw.ModTime = o.Time
	if _, err := zw.Write(b.Bytes()); err != nil {
		return nil, nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, nil, err
	}
	return b.Bytes(), z.Bytes(), nil
}

// Build writes the image tarball to w.
func Build(w io.Writer, o Options) (Image, error) {
	raw, gz, err := layer(o)
	if err != nil {
		return Image{}, err
	}
	img := Image{LayerDigest: digest(gz), DiffID: digest(raw), LayerSize: int64(len(gz))}
	var cfg Config
	cfg.Created, cfg.Architecture, cfg.OS = o.Time.UTC(), o.Arch, "linux"
	cfg.Config.User = strconv.Itoa(UID) + ":" + strconv.Itoa(UID)
	cfg.Config.Entrypoint = []string{"/" + BinaryPath}
	cfg.Config.Cmd = []string{"serve"}
	// Listen on every interface inside the container (the binary's default is loopback).
	cfg.Config.Env = []string{"ESCROW_ADDR=0.0.0.0:8080", "SSL_CERT_FILE=/" + CAPath}
	cfg.Config.ExposedPorts = map[string]struct{}{Port: {}}
	cfg.Config.WorkingDir = "/var/lib/escrow"
	cfg.Config.Labels = map[string]string{"org.opencontainers.image.title": "escrow",
		"org.opencontainers.image.description": "prepaid balances and holds in front of an OpenAI-compatible API"}
	cfg.RootFS.Type, cfg.RootFS.DiffIDs = "layers", []string{img.DiffID}
	cfg.History = append(cfg.History, struct {
		Created   time.Time `json:"created"`
		CreatedBy string    `json:"created_by"`
	}{o.Time.UTC(), "scripts/image: escrow, CA bundle, passwd (FROM scratch)"})
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return Image{}, err
	}
	img.ConfigDigest = digest(cfgJSON)
	man := manifest{SchemaVersion: 2, MediaType: "application/vnd.oci.image.manifest.v1+json",
		Config: descriptor{MediaType: "application/vnd.oci.image.config.v1+json", Digest: img.ConfigDigest, Size: int64(len(cfgJSON))},
		Layers: []descriptor{{MediaType: "application/vnd.oci.image.layer.v1.tar+gzip", Digest: img.LayerDigest, Size: img.LayerSize}}}
	manJSON, err := json.Marshal(man)
	if err != nil {
		return Image{}, err
	}
	img.ManifestDigest = digest(manJSON)
	ann := map[string]string{"org.opencontainers.image.ref.name": refName(o.Tag), "io.containerd.image.name": o.Tag}
	idxJSON, _ := json.Marshal(index{SchemaVersion: 2, MediaType: "application/vnd.oci.image.index.v1+json",
		Manifests: []descriptor{{MediaType: man.MediaType, Digest: img.ManifestDigest, Size: int64(len(manJSON)), Annotations: ann}}})
	blob := func(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }
	dockerJSON, _ := json.Marshal([]dockerManifest{{Config: blob(img.ConfigDigest), RepoTags: []string{o.Tag}, Layers: []string{blob(img.LayerDigest)}}})

	tw := tar.NewWriter(w)
	put := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)), ModTime: o.Time}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	dirs := func(names ...string) error {
		for _, n := range names {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: n, Mode: 0o755, ModTime: o.Time}); err != nil {
				return err
			}
		}
		return nil
	}
	err = errors.Join(dirs("blobs/", "blobs/sha256/"),
		put(blob(img.ConfigDigest), cfgJSON), put(blob(img.LayerDigest), gz), put(blob(img.ManifestDigest), manJSON),
		put("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)), put("index.json", idxJSON), put("manifest.json", dockerJSON),
		tw.Close())
	return img, err
}

// refName is the tag part of repository:tag ("latest" when there is none).
func refName(tag string) string {
	if i := strings.LastIndex(tag, ":"); i >= 0 && !strings.Contains(tag[i:], "/") {
		return tag[i+1:]
	}
	return "latest"
}

func main() {
	var o Options
	out := flag.String("out", "bin/escrow-image.tar", "the image tarball to write")
	flag.StringVar(&o.Binary, "binary", "bin/escrow", "the static escrow binary (CGO_ENABLED=0)")
	flag.StringVar(&o.CA, "ca", "/etc/ssl/certs/ca-certificates.crt", "the CA bundle to put in the image")
	flag.StringVar(&o.Tag, "tag", "escrow:latest", "the image's name for docker load")
	flag.StringVar(&o.Arch, "arch", runtime.GOARCH, "the binary's GOARCH")
	flag.Parse()
	o.Time = time.Unix(0, 0).UTC()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			fmt.Fprintln(os.Stderr, "image: SOURCE_DATE_EPOCH:", err)
			os.Exit(2)
		}
		o.Time = time.Unix(n, 0).UTC()
	}
	f, err := os.Create(*out)
	if err == nil {
		var img Image
		img, err = Build(f, o)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			st, _ := os.Stat(*out)
			fmt.Printf("image %s: %s (%.1f MB; manifest %s) — load it with: docker load -i %s\n",
				o.Tag, *out, float64(st.Size())/1e6, img.ManifestDigest, *out)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}
